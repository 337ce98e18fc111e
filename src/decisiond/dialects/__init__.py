"""Wire formats: one pure translation module per dialect (``base.Dialect``), no model and no network."""
