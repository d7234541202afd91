"""ppojax.tasks.count."""
