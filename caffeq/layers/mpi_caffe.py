"""steflee/mpi-caffe (5ee47a0): a net spread over MPI processes, read as the one process caffeq is (rank 0 of
a world of 1).

- NetStateRule.mpi_rank: a rule holds only on the ranks it lists (caffeq/ir.py keeps rank 0's layers).
- MPIBroadcast (mpi_broadcast_layer.cpp): the root's bottom sent to every rank; on the root, top = bottom.
- MPIGather (mpi_gather_layer.cpp): top i is the bottom computed on rank i, and the fork CHECKs that the
  world has as many ranks as the layer has tops (each rank with its own weights): read, not run.
"""
from .registry import AT_LEAST, IdentityLayer, LayerError, ReadOnlyLayer, need_blobs, register_layer


@register_layer("MPIBroadcast")
class MPIBroadcast(IdentityLayer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        if lp.mpi_param.root != 0:
            raise LayerError(f"MPIBroadcast's root is rank {lp.mpi_param.root}; caffeq runs the net as one "
                             "process, rank 0, which holds the bottom only when it is the root")
        return {}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])]



@register_layer("MPIGather")
class MPIGather(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, range(1, AT_LEAST))
        return {"name": lp.name, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])] * attrs["tops"]

    def why_not_run(self, attrs):
        return (f"its {attrs['tops']} tops are the bottoms of {attrs['tops']} MPI processes, each with its own "
                "weights (the fork checks the world has that many ranks); caffeq runs one process")
