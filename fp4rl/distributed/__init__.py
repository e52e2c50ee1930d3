"""Scale-out of the RL loop's rollouts and weight sync: shards (one sharding and seeding rule for every
backend), Ray actors (ray_pool), torch.distributed ranks (torch_dist). Ray and torch.distributed are imported
only by the modules that use them."""

from fp4rl.distributed.shards import (
    LocalShards,
    generate_sharded,
    merge,
    shard_bounds,
    shard_params,
    shard_seed,
)

__all__ = ["LocalShards", "generate_sharded", "merge", "shard_bounds", "shard_params", "shard_seed"]
