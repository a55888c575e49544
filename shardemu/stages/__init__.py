"""What every multi-stage engine runs on: stage meshes and their compiled pieces
(`stage.py`), the executor that runs or shapes pieces and transfers and records them
(`executor.py`), and the memory tiers (`tiers.py`). The phased engine and the pipelined
engine are programs over these."""
