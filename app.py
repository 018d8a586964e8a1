"""`python app.py [flags]` serves kvscope from a checkout, as `kvscope serve [flags]` does
where it is installed; the Hugging Face Space runs this file. The code is kvscope/app.py."""

from kvscope.app import main

if __name__ == "__main__":
    main()
