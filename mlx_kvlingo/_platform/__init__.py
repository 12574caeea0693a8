"""Platform helpers, private: BLAS preload, huge pages, CPU memory, cache folder, atomic writes,
MoE on the CPU."""
