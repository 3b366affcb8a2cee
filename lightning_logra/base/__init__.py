"""What every layer uses: hashing, batches, schedules, waits. Imports nothing else of the project."""
