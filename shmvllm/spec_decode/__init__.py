"""Speculative decoding: proposers (n-gram prompt lookup) and the verification of their
proposals by the target model (greedy match, or rejection sampling for temperature > 0)."""
