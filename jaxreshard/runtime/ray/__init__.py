"""The Ray runtime: host actors, their channels and NCCL order, the driver's side."""
