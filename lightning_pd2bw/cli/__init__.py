"""The command lines: ``pd2bw-train`` (``train``: the Hydra entry point, dry run included), its schemas and
cross-field checks (``config``), ``pd2bw-plan`` (``plan``) and ``pd2bw-consolidate`` (``consolidate``)."""
