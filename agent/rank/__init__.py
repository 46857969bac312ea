"""Everything that runs inside a training process: the recorder and what feeds it.

The recorder (`recorder`), its transport to the node agent (`transport`), the import hooks that
put it into every rank without a change to the script (`autoinstall`), the patches that feed it
(`hooks`: torch.distributed's collectives, process groups, DDP, optimizer steps; `functional`:
functional collectives; `backend`: each group's progress as its backend counts it), the
checkpoint helper, the exit status file and the warm spare. Code here must never raise into the
training process, block it or slow it measurably; it imports nothing of the node agent
(`agent.node`) or the health sources (`agent.sources`).
"""
