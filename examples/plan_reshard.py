"""Plan one cross-mesh resharding and print what moves where.

    python examples/plan_reshard.py

Two meshes of 8 devices each on a cluster of 4 hosts x 4 devices (the paper's cluster): the
source shards dim 1 over the mesh's "x" axis, the destination shards dim 0. The devices are
virtual, so this runs anywhere; with real JAX devices pass `NamedSharding`s instead.
"""

from jax.sharding import PartitionSpec as P

from jaxreshard.comm import Cluster, VirtualMesh, VirtualSharding, plan_reshard, validate_plan

cluster = Cluster.uniform(num_hosts=4, devices_per_host=4)
host_of = {d: cluster.host_of(d) for host in cluster.hosts for d in host}
src_mesh = VirtualMesh.from_ids((2, 4), ("x", "y"), range(0, 8), host_of)
dst_mesh = VirtualMesh.from_ids((2, 4), ("x", "y"), range(8, 16), host_of)
src = VirtualSharding(src_mesh, P(None, "x"))
dst = VirtualSharding(dst_mesh, P("x"))

for strategy in ("allgather", "broadcast_naive", "auto"):
    plan = plan_reshard((1024, 1024, 512), "float32", src, dst, cluster=cluster, strategy=strategy)
    assert not validate_plan(plan)
    print(plan, end="\n\n")
