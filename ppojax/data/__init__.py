"""Records on disk, prompts encoded through chat templates and padded, the batch of prompts the
step receives."""
