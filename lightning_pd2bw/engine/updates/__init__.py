"""The update's parts: the rule a stage steps by (``update``), built once per run (``update_build``) from parts
(``update_parts``, placed by ``schedules/placement``; STEP's ``stepper``) that issue their declared collectives (``collectives``); where the
gradients accumulate and are reduced (``gradient_store``, ``grad_buckets``, ``gradients``), the owners' shards
(``sharding``) and the delay correction (``delay_correction``)."""
