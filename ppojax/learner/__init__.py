"""The RL step: its state records, the experience (rewards, advantages), the update and the
compiled step that composes rollout → scores → experience → update."""
