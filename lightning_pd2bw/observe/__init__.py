"""What a run shows about itself, beside the engine (which reports through ``engine.observer`` and never imports
this package): the watchdog that ends a hung or orphaned job with a verdict, per-action timelines and their Chrome
trace and Gantt chart, text pictures of the schedules, and the activation meter."""
