"""Parallelism over several devices or processes: tensor parallelism over `torch.distributed`."""

from .launch import RankFailedError, free_port, launch
from .tensor_parallel import (CollectiveTimer, RowParallelLinear, check_tensor_parallel, init_distributed,
                              shard_model, sharded_parameter_bytes, tensor_parallel)

__all__ = ["CollectiveTimer", "RankFailedError", "RowParallelLinear", "check_tensor_parallel", "free_port",
           "init_distributed", "launch", "shard_model", "sharded_parameter_bytes", "tensor_parallel"]
