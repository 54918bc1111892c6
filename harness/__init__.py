"""What tests and benchmarks both run against the real engine: its releases on the path,
ranks in interpreters of their own (gloo or NCCL), doctored copies of its modules, the
process groups and the DSpark objects the cases drive. Not part of the installed pack."""
