"""Pure jnp math of RL fine-tuning: masked statistics, KL estimators, reward shaping,
advantage estimators, losses, the algorithm record and the optimizers. Imports only infra."""
