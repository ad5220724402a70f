"""Tensor parallelism: the ranks' communicator (`group`), the split (`split`) and the layers built at
their rank's shapes, each loading only its share of the checkpoint (`layers`)."""
