"""Collectives over the MRC transport: all_reduce, reduce_scatter, all_gather, broadcast,
barrier, send/recv among world_size ranks, one rank per datapath instance.

    from mrc_xdp.collective import Communicator, StoreServer, StoreClient

    srv = StoreServer("::", 29500) if rank == 0 else None        # rendezvous, rank 0
    store = StoreClient(master_addr, 29500)
    with Communicator(rank, world_size, store, instance="mrc-h%d" % rank) as comm:
        comm.all_reduce(grad, op="sum")                           # numpy, in place

Knows nothing of PyTorch: mrc_xdp.torch adapts it to torch.distributed.
"""
from mrc_xdp.collective.comm import CollectiveError, Communicator
from mrc_xdp.collective.reduce import DTYPES, ReduceOp
from mrc_xdp.collective.store import StoreClient, StoreError, StoreServer, TorchStore

__all__ = ["Communicator", "CollectiveError", "ReduceOp", "DTYPES", "StoreServer", "StoreClient",
           "StoreError", "TorchStore"]
