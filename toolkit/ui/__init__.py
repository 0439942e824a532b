"""The local web UI (`./start_toolkit.sh ui`): a thin layer over the config validator, the launcher and the run
folders. serve.py starts it, app.py holds the routes, runs.py and run_files.py read run folders, jobs.py starts and
queues runs as separate processes, configs.py checks YAML as the `validate` command does; static/ is the page."""
