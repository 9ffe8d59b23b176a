"""Scheduling, offline: trajectories of every round under all 32 schedules, the value system and its exact
margins, the distillation into the 3,265-parameter scheduler, and its fit for the device it runs on. What
runs at serving time is only the fitted artifact (`decoding.scheduler`)."""
