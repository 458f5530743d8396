"""Verification of the engine's communication under NCCL's rules, without GPUs: ``nccl_model`` executes per-rank
programs as NCCL would (a send completes only when matched, a communicator's ops run in issue order, kernels of
different communicators may run one at a time) and ``comm_plan`` lowers the engine's schedules to those programs.
Used by the tests and by ``pd2bw-train dry_run=true``; nothing here runs during training."""
