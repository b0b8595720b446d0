"""Observability: the timeline the engine records, Chrome-trace export and Gantt pictures (``gantt``)."""
