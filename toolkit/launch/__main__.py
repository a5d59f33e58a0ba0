from toolkit.launch.node import main

main()
