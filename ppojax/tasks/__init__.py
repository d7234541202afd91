"""Tasks with verifiable rewards (count, arith, reasoning-gym) and where a run's prompts come
from (sources)."""
