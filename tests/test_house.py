"""The house, kept livable (issue 58), checked from the source: no function over 60 lines and no module over 500,
no ``assert`` (``python -O`` removes them), nothing in ``decisiond.server`` importing the app that mounts it, and
at most 4 places in ``server/`` where a ``DecisionError`` becomes a response (an ``except`` that catches it and
builds an answer: a response, a rendered error, an ``Answer``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "decisiond"
FILES = sorted(p for p in SRC.rglob("*.py") if "migrations" not in p.parts)
TREES = {path: ast.parse(path.read_text()) for path in FILES}

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
MAX_ERROR_ANSWERS = 4


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"


def test_the_source_is_read():
    assert len(FILES) > 100 and SRC / "server" / "app.py" in TREES


def test_no_function_over_60_lines():
    long = [f"{_where(path, node)} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (node.end_lineno or 0) - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_no_module_over_500_lines():
    big = [f"{path.relative_to(SRC)} ({n} lines)" for path in FILES
           if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert big == []


def test_no_assert_in_src():
    asserts = [_where(path, node) for path, tree in TREES.items() for node in ast.walk(tree)
               if isinstance(node, ast.Assert)]
    assert asserts == []


def _imported(path: Path, tree: ast.AST) -> set[str]:
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def test_nothing_in_server_imports_the_app():
    server = [path for path in FILES if path.parent == SRC / "server" and path.name != "app.py"]
    assert [str(path.relative_to(SRC)) for path in server
            if "decisiond.server.app" in _imported(path, TREES[path])] == []


def _catches_decision_error(handler: ast.ExceptHandler) -> bool:
    return handler.type is not None and "DecisionError" in ast.unparse(handler.type)


def _answers(handler: ast.ExceptHandler) -> bool:
    """Whether the handler builds an answer (a response, a rendered error, an ``Answer``, a route's ``answer``) and
    does not raise the error on (one that does has only noted it, for a record or a log line)."""
    if isinstance(handler.body[-1], ast.Raise) and handler.body[-1].exc is None:
        return False
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name.endswith(("Response", "_error", "Answer", "answer")) or name == "error_response":
                return True
    return False


def _error_answers() -> list[str]:
    return [_where(path, node) for path, tree in TREES.items() if path.parent == SRC / "server"
            for node in ast.walk(tree)
            if isinstance(node, ast.ExceptHandler) and _catches_decision_error(node) and _answers(node)]


def test_few_places_turn_a_decision_error_into_a_response():
    assert len(_error_answers()) <= MAX_ERROR_ANSWERS, _error_answers()


def test_an_answering_handler_would_be_counted():
    answered = ast.parse("try:\n    pass\nexcept DecisionError as error:\n    return openai_error(error)\n").body[0]
    noted = ast.parse("try:\n    pass\nexcept DecisionError as error:\n    body = render_error(error)\n    raise\n").body[0]
    assert isinstance(answered, ast.Try) and _answers(answered.handlers[0])
    assert isinstance(noted, ast.Try) and not _answers(noted.handlers[0])
