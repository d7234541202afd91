"""ppojax.core."""
