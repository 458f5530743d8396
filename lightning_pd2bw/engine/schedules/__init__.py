"""The schedule and its lowering: the action lists a stage runs (``schedule``), their vocabulary (``actions``) and
the lowering to the ops the executor runs, the NCCL model checks and the simulator times (``lowering``)."""
