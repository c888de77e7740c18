"""`python -m library.models.tiny FOLDER --family NAME`: the same command as `python -m library.families.tiny`."""
from library.families.tiny import main

if __name__ == "__main__":
    raise SystemExit(main())
