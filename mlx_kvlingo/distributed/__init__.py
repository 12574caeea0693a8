"""The large model pipelined over ranks (`mlx.launch`), its session and its watchdog."""
