module embarcadero/peers/redisbench

go 1.26.0

require embarcadero/peers/loadgen v0.0.0

replace embarcadero/peers/loadgen => ../loadgen
