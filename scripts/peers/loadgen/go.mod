module embarcadero/peers/loadgen

go 1.26.0
