"""Tensor parallelism: the ranks' communicator (`group`) and the sharded Llama layers (`layers`)."""
