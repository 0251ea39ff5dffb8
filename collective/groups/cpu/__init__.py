"""CpuGroup: the CPU backend; shared memory inside a node, Gloo between nodes, picked at init.

``connect`` decides at init which transports run; ``base`` runs, fails and ends the
ops; ``group`` holds the ops; ``plans`` composes shared memory and Gloo across nodes.
This is the one package that knows both CPU transports.
"""
