"""Processes and process groups, split by role:

- env: where this process runs (torchrun's variables, devices, threads, memory); the ONLY module that
  reads RANK / WORLD_SIZE / LOCAL_RANK and the rest of torchrun's environment;
- group: who this process is in the run (`Context`), joining and leaving the process group
  (`session`, nccl or gloo), the collectives and their timeouts;
- launch: starting local workers (fork or spawn), watching their exits and heartbeats, `leave`;
- signals: exit statuses, `Interrupted`, and SIGINT / SIGTERM turned into an orderly stop
  (standard library only, so the command line names them without importing torch).

Three ways a process can be part of a run:
- alone (world size 1): no process group at all;
- spawned by `launch` for `--devices N`: rendezvous through a FileStore in a private temp folder,
  so no code names a port;
- started by torchrun (RANK and WORLD_SIZE set): join the group torchrun describes (env://).
"""
