from azqemu.cli import main

main()
