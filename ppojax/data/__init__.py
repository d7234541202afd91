"""ppojax.data.encoding."""
