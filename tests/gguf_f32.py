"""A float32 GGUF of the same weights as a quantized one, written with the ``gguf`` package: every key of the
source copied, ``general.file_type`` set to all-float32, and every tensor de-quantized (``gguf.quants``). llama.cpp
then runs the weights the in-process engine runs, without its quantized dot products."""

from __future__ import annotations

from pathlib import Path

ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32


def _value(field, kind):
    import gguf

    if kind == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
    return [field.parts[i].tolist()[0] for i in field.data]


def write_f32(source: str | Path, target: str | Path) -> Path:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(target), bytes(arch.parts[arch.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, _value(field, field.types[1]), kind, sub_type=field.types[1])
        else:
            writer.add_key_value(name, _value(field, kind)[0], kind)
    writer.add_file_type(ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data.reshape(list(reversed([int(x) for x in tensor.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)
