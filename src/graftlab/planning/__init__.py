"""Planning a run before any job starts: the results layout, continual chains, config resolution and checks,
each job's work, its scheduler resources, the cost plan and disk use. Standard library only (the workflow
imports it on every parse, a dry-run's too)."""
