"""Where numpy arrays, torch tensors and cupy arrays are recognised; the only room that knows them.

This room owns everything the library asks of a framework's buffer: ``kinds`` tells the
frameworks apart and describes a buffer (``spec``, dtype names, contiguity), ``dtypes``
is the one dtype table, ``memory`` says where a buffer's elements lie (overlaps,
aliases, write hazards, Ray's object store through ``objectstore``), ``cpu_buffers``
wraps CPU buffers for the CPU transports and ``cuda_buffers`` GPU buffers and streams
for NCCL, ``streams`` orders work on the caller's CUDA stream, ``packing`` packs many
buffers into staging buckets, ``bytelist`` moves lists of byte runs and ``prints``
fingerprints a list of buffers. It imports nothing of the package but
``collective.types`` and ``collective._version``; numpy, torch and cupy are imported
only when a buffer of theirs is seen.
"""
