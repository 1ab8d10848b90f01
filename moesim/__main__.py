from moesim.cli import main

main()
