"""The search's work: a worker process's loop (`worker`: it claims tasks from the store and trains them)
and its driver threads (`driver`: each plays one search through the queue). Import from the module."""
