"""ppojax.run."""
