"""What every layer may use: atomic files, host memory, device meshes and sharding, FLOP counts,
stop signals, the command lines' error handling. Imports nothing of ppojax above it."""
