"""``decisiond bench``: a reproducible decision workload measured side by side in one run."""
