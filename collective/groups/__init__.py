"""Where bytes move: the backends behind one abstract group API, and what they share.

This room owns ``BaseGroup`` (``base``: the API every backend implements, and
``launches``: the launches a group keeps, built once per call key) and the pieces
every backend uses: ``lanes`` runs a group's ops in issue order, ``watch`` spreads
one rank's failure to every rank, ``progress`` asks the peers how far they got
when an op times out, and ``topology`` learns which ranks share a node. One folder
per backend or transport sits below it: ``cpu`` (the CPU group), ``shm`` (shared
memory), ``gloo``, ``nccl``, ``shared_gpu`` (ranks that share a GPU, through CUDA
IPC) and ``gpu`` (the GPU group). The shared pieces import ``collective.rendezvous``
(the store the ranks meet through), ``collective.frameworks``, ``collective.types``
and ``collective.work``; a transport never imports another, except that the CPU
group composes ``shm`` and ``gloo``, the GPU group composes ``nccl`` and
``shared_gpu``, and ``shared_gpu`` runs its host side on ``shm``'s step protocol.
"""
