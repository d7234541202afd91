"""ppojax.supervised.common."""
