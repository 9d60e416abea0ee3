"""Adapters from exported rows to the input types of RL trainers: skyrl, verl, verifiers (prime-rl)."""
