module embarcadero/peers/redisbench

go 1.26.0
