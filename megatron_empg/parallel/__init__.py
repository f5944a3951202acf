"""torch.distributed layer: vocab-parallel autograd Functions; every process group is an argument."""
