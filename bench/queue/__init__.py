"""The store as the queue: tasks a second beside Optuna's trials (`store_queue.py`), a whole search under
kills (`queue_stress.py`), a trivial objective's overhead per trial as the history grows
(`objective_overhead.py`, Optuna's side in `overhead_optuna.py`), real searches on 1 and 2 workers and a
joining worker (`search_workers.py`), a worker joining a search of a long history (`worker_join.py`), the
same work as a plain Optuna script (`optuna_same_work.py` over `plain_optuna.py`), how busy a search keeps
its workers (`search_busy.py`); a private PostgreSQL server for them (`postgres.py`)."""
