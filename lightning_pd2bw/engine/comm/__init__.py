"""The transport: the process grid and its communicators (``grid``), the stage-to-stage messages (``transport``)
and how a batch splits into microbatches (``microbatch``)."""
