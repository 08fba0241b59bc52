"""How the model is spread over the devices: process group and mesh, FSDP2/DDP, tensor, pipeline and context
parallelism, float8, mixed precision, activation checkpointing and offload."""
