"""ppojax.infra."""
