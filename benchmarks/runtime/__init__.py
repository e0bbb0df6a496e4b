"""What every command uses: argument parsing and launching ranks."""
